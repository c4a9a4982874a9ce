"""The decode-attention kernel (`moetier::decode_attention`) against its twin (repeat kv + SDPA
with the position mask): awkward shapes, forced and chosen splits, strided caches, keys past
the position never read; fp32 under Triton's interpreter on CPU (its bf16 `tl.dot` is wrong),
bf16 and CUDA graphs on the GPU. Then a tiny native qwen3_moe model decoding through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moetier.config import EngineConfig
from moetier.engine.static_decode import StaticDecoder
from moetier.kernels.attention import (
    SPLIT_THRESHOLD,
    choose_config,
    decode_attention,
    decode_attention_ref,
)
from moetier.loader.load import load_model
from moetier.models import layers

pytest.importorskip("triton")
from moetier.kernels.attention import decode_attention_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows(q):
    """The page table of a static cache [B, KVH, L, D]: one page of L positions per row, as a
    table ([[0], [1], ...]); the models pass None for it."""
    return torch.arange(q.shape[0], dtype=torch.int32, device=q.device)[:, None]


# (batch, heads, kv_heads, head_dim, max_len, positions, splits); splits None: choose_config's
CASES = [
    (1, 4, 4, 64, 70, [69], None),  # groups 1, max_len not a multiple of the key block
    (3, 16, 4, 128, 100, [0, 99, 37], None),  # groups 4, positions 0 and max_len - 1
    (3, 16, 2, 64, 130, [129, 0, 64], None),  # groups 8
    (3, 32, 4, 64, 200, [0, 199, 128], 3),  # split path, forced
    (2, 8, 1, 128, 150, [149, 31], 5),  # split path, a row ending in the first split
    (1, 4, 2, 64, 90, [45], 8),  # more splits than key blocks: empty splits
    (1, 4, 1, 64, SPLIT_THRESHOLD + 88, [SPLIT_THRESHOLD + 87], None),  # split path, chosen
]


def make_inputs(batch, heads, kv_heads, dim, max_len, positions, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed + batch * heads + dim + max_len)
    q = (torch.randn(batch, heads, 1, dim, generator=gen) * 2).to(dtype).to(device)
    k = torch.randn(batch, kv_heads, max_len, dim, generator=gen).to(dtype).to(device)
    v = torch.randn(batch, kv_heads, max_len, dim, generator=gen).to(dtype).to(device)
    return q, k, v, torch.tensor(positions, device=device)


def check_case(case, dtype, device, atol, rtol):
    batch, heads, kv_heads, dim, max_len, positions, splits = case
    q, k, v, pos = make_inputs(batch, heads, kv_heads, dim, max_len, positions, dtype, device)
    got = decode_attention_triton(q, k, v, rows(q), pos, dim**-0.5, splits=splits)
    want = decode_attention_ref(q, k, v, rows(q), pos, dim**-0.5)
    assert got.dtype == dtype and got.shape == (batch, heads, 1, dim)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_ref_fp32(case):
    check_case(case, torch.float32, DEVICE, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    CASES
    + [
        (1, 32, 4, 128, 300, [299], None),  # Qwen3-30B-A3B's heads, one pass
        (1, 32, 4, 128, 4096, [4095], None),  # split path, chosen
        (8, 32, 4, 128, 2048, [5, 2047, 1000, 0, 64, 63, 1500, 700], None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_ref_16bit_gpu(case, dtype):
    check_case(case, dtype, "cuda", atol=2e-2, rtol=2e-2)


def test_strided_operands():
    """Views as Attention passes them: q a transpose of [B, 1, H, D], the caches one layer's
    slice of a [layers, 2, B, kvh, L, D] cache; then a cache strided in batch and position."""
    batch, heads, kv_heads, dim, max_len = 3, 8, 2, 64, 80
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 2, batch, kv_heads, max_len, dim, generator=gen).to(DEVICE)
    q = torch.randn(batch, 1, heads, dim, generator=gen).to(DEVICE).transpose(1, 2)
    pos = torch.tensor([[5], [79], [0]], device=DEVICE)[:, 0]
    got = decode_attention(q, cache[1, 0], cache[1, 1], rows(q), pos, 0.125)
    want = decode_attention_ref(q, cache[1, 0], cache[1, 1], rows(q), pos, 0.125)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    wide = torch.randn(2 * batch, kv_heads, 2 * max_len, dim, generator=gen).to(DEVICE)
    k, v = wide[::2, :, ::2], wide[1::2, :, 1::2]  # [B, kvh, L, D], strided in B and L
    for splits in (1, 3):
        got = decode_attention_triton(q, k, v, rows(q), pos, 0.125, splits=splits)
        torch.testing.assert_close(
            got, decode_attention_ref(q, k, v, rows(q), pos, 0.125), atol=2e-5, rtol=1e-5
        )


@pytest.mark.parametrize("splits", [1, 4])
def test_reads_nothing_past_the_position(splits):
    """Cache entries after each row's position hold NaN and inf: the output is that of a cache
    with them zeroed (a kernel that read them, even masked, would turn NaN)."""
    q, k, v, pos = make_inputs(2, 8, 2, 64, 120, [40, 3], torch.float32, DEVICE)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    after = torch.arange(120, device=DEVICE)[None, :] > pos[:, None]  # [B, L]
    poisoned_k[after[:, None, :, None].expand_as(k)] = float("nan")
    poisoned_v[after[:, None, :, None].expand_as(v)] = float("inf")
    got = decode_attention_triton(q, poisoned_k, poisoned_v, rows(q), pos, 0.125, splits=splits)
    clean = after[:, None, :, None].logical_not()
    want = decode_attention_ref(q, k * clean, v * clean, rows(q), pos, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def paged_inputs(page_size, lengths, kv_heads=2, heads=8, dim=64, spare=3, seed=5):
    """Rows of `lengths` positions in shuffled pages of a pool with `spare` pages of no row (NaN:
    a kernel reading them would turn NaN); -> q, k_pages, v_pages, table, positions, and the
    rows' caches laid out contiguously [B, KVH, L, D] by a plain loop (the independent side)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // page_size) for n in lengths)
    count = len(lengths) * width + spare
    order = torch.randperm(count, generator=gen)
    k_pages = torch.full((count, kv_heads, page_size, dim), float("nan"))
    v_pages = torch.full_like(k_pages, float("nan"))
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    flat_k = torch.zeros(len(lengths), kv_heads, width * page_size, dim)
    flat_v = torch.zeros_like(flat_k)
    for b, n in enumerate(lengths):
        for w in range(-(-n // page_size)):
            page = int(order[b * width + w])
            table[b, w] = page
            k_pages[page] = torch.randn(kv_heads, page_size, dim, generator=gen)
            v_pages[page] = torch.randn(kv_heads, page_size, dim, generator=gen)
            flat_k[b, :, w * page_size : (w + 1) * page_size] = k_pages[page]
            flat_v[b, :, w * page_size : (w + 1) * page_size] = v_pages[page]
    q = torch.randn(len(lengths), heads, 1, dim, generator=gen)
    positions = torch.tensor([n - 1 for n in lengths])
    tensors = (q, k_pages, v_pages, table, positions, flat_k, flat_v)
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("page_size, splits", [(16, 1), (16, 3), (32, 1), (64, 2)])
def test_paged_cache_matches_the_rows_laid_out(page_size, splits):
    """Pages shuffled through the pool, rows of different lengths (a partial last page holds
    NaN past the position), pages of no row poisoned: equal to the static cache of each row's
    positions in order."""
    lengths = [1, 37, 64, 100]
    q, k, v, table, pos, flat_k, flat_v = paged_inputs(page_size, lengths)
    got = decode_attention_triton(q, k, v, table, pos, 0.125, splits=splits)
    flat_k, flat_v = flat_k.nan_to_num(), flat_v.nan_to_num()
    want = decode_attention_ref(q, flat_k, flat_v, rows(q), pos, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    clean_k, clean_v = k.nan_to_num(), v.nan_to_num()
    via_ref = decode_attention_ref(q, clean_k, clean_v, table, pos, 0.125)
    torch.testing.assert_close(via_ref, want, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_cache_16bit_gpu(dtype):
    lengths = [1, 300, 2048, 777, 16, 64, 65, 1000]
    q, k, v, table, pos, flat_k, flat_v = paged_inputs(16, lengths, kv_heads=4, heads=32, dim=128)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    got = decode_attention(q, k, v, table, pos, 0.1)
    flat_k, flat_v = flat_k.nan_to_num().to(dtype), flat_v.nan_to_num().to(dtype)
    want = decode_attention_ref(q, flat_k, flat_v, rows(q), pos, 0.1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits", [1, 3])
def test_static_cache_without_a_page_table(splits):
    """No page table: row b reads page b (the static cache's kernel, no table lookups), equal to
    the same cache through the identity table, and to the twin."""
    q, k, v, pos = make_inputs(3, 8, 2, 64, 90, [89, 0, 40], torch.float32, DEVICE)
    got = decode_attention_triton(q, k, v, None, pos, 0.125, splits=splits)
    via_table = decode_attention_triton(q, k, v, rows(q), pos, 0.125, splits=splits)
    torch.testing.assert_close(got, via_table, atol=0, rtol=0)
    want = decode_attention_ref(q, k, v, None, pos, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        decode_attention(q, k, v, None, pos, 0.125), want, atol=2e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="one row per query row"):
        decode_attention(q[:2], k, v, None, pos[:2], 0.125)


def test_choose_config_splits_from_shapes():
    fp32, bf16 = torch.float32, torch.bfloat16
    assert choose_config(1, 4, SPLIT_THRESHOLD, bf16).splits == 1  # short caches: one pass
    assert choose_config(1, 4, 4096, bf16).splits == 32  # 128 programs of 128 positions
    assert choose_config(8, 4, 4096, bf16).splits == 9  # 288 programs: ~2 per H200 SM
    assert choose_config(64, 4, 4096, bf16).splits == 2
    assert choose_config(1, 4, 100, bf16, split_threshold=64).splits == 1  # 100 < 128 per split
    assert choose_config(1, 1, 1000, fp32, split_threshold=256).splits == 8
    config = choose_config(1, 4, 4096, bf16)
    assert (config.block_l, config.num_warps) == (64, 4)
    assert choose_config(1, 4, 4096, fp32).block_l == 32


SM90_COMPILE = """
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetier.kernels import attention

config = attention.choose_config(1, 4, 4096, torch.bfloat16)
pointers = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "out": "*bf16", "positions": "*i64",
            "page_table": "*i32",
            "part_o": "*fp32", "part_lse": "*fp32", "scale_log2": "fp32"}
decode = dict(sp=1, spt=1, G=8, KVH=4, BLOCK_G=16, BLOCK_L=config.block_l, BLOCK_D=128,
              PRECISION="tf32")
kernels = [("single", attention._decode_attention_kernel, dict(decode, SPLITS=1, PAGED=True)),
           ("split", attention._decode_attention_kernel, dict(decode, SPLITS=32, PAGED=True)),
           ("static", attention._decode_attention_kernel, dict(decode, SPLITS=1, PAGED=False)),
           ("combine", attention._combine_splits_kernel, dict(SPLITS=32, BLOCK_S=32, BLOCK_D=128))]
ptx = {}
for name, fn, constants in kernels:
    signature = {arg: "constexpr" if arg in constants else pointers.get(arg, "i32")
                 for arg in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )
    ptx[name] = compiled.asm["ptx"]
print(json.dumps({name: [len(text) > 0, "mma.sync" in text] for name, text in ptx.items()}))
"""


def test_compiles_for_sm90():
    """The kernels compile for the H200 (sm_90) without a GPU (Triton's bundled ptxas), at
    Qwen3-30B-A3B's shape in bf16, the decode kernel's dots on tensor cores: a construct only
    the interpreter accepts fails here rather than on the GPU. In a subprocess: this process's
    Triton was imported in interpreter mode (conftest)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {
        "single": [True, True],
        "split": [True, True],
        "static": [True, True],
        "combine": [True, False],
    }


def test_op_and_opcheck():
    """The op (on CPU the interpreter runs the kernel: conftest sets TRITON_INTERPRET), its
    schema and fake against the real one."""
    q, k, v, pos = make_inputs(2, 8, 2, 64, 40, [39, 7], torch.float32, DEVICE)
    got = decode_attention(q, k, v, rows(q), pos, 0.125)
    torch.testing.assert_close(
        got, decode_attention_ref(q, k, v, rows(q), pos, 0.125), atol=2e-5, rtol=1e-5
    )
    torch.library.opcheck(decode_attention, (q, k, v, rows(q), pos, 0.125))


def test_refuses_bad_operands():
    q, k, v, pos = make_inputs(2, 6, 4, 64, 40, [39, 7], torch.float32, "cpu")
    with pytest.raises(ValueError, match="not a multiple of 4 kv heads"):
        decode_attention(q, k, v, rows(q), pos, 0.125)
    q, k, v, pos = make_inputs(2, 8, 4, 64, 40, [39, 7], torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"q must be \[B, H, 1, D\]"):
        decode_attention(q.expand(2, 8, 2, 64), k, v, rows(q), pos, 0.125)
    with pytest.raises(ValueError, match="positions must be"):
        decode_attention(q, k, v, rows(q), pos[:1], 0.125)
    half = [t.to(torch.bfloat16) for t in (q, k, v)]
    with pytest.raises(ValueError, match="differ in dtype"):
        decode_attention(half[0], k, v, rows(q), pos, 0.125)
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(ValueError, match="interpreter computes 16-bit"):
            decode_attention_triton(*half, rows(q), pos, 0.125)
        # the op takes the twin instead
        torch.testing.assert_close(
            decode_attention(*half, rows(q), pos, 0.125),
            decode_attention_ref(*half, rows(q), pos, 0.125),
        )


@pytest.mark.gpu
def test_cuda_graph_replay():
    """Captured once (split path and not), replays for new positions and cache contents."""
    for max_len in (256, 2048):
        q, k, v, pos = make_inputs(2, 32, 4, 128, max_len, [9, 100], torch.bfloat16, "cuda")
        decode_attention(q, k, v, rows(q), pos, 0.1)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention(q, k, v, rows(q), pos, 0.1)
        for step in range(3):
            q.copy_(torch.randn_like(q))
            k[:, :, step].normal_()
            pos.copy_(torch.tensor([max_len - 1 - step, 17 * step], device="cuda"))
            graph.replay()
            torch.testing.assert_close(
                out, decode_attention_ref(q, k, v, rows(q), pos, 0.1), atol=2e-2, rtol=2e-2
            )


def decode_steps(loaded, prompts, feed, device):
    """Logits of a right-padded prefill then one decode step per column of feed [B, S]."""
    decoder = StaticDecoder(loaded.model, len(prompts), 48, loaded.dtype, device)
    logits = [decoder.prefill(prompts)]
    logits += [decoder.step(feed[:, s]) for s in range(feed.shape[1])]
    return torch.stack(logits)  # [S + 1, B, V]


def test_native_decode_through_the_kernel(tiny, monkeypatch):
    """The tiny native qwen3_moe decodes rows at different positions through the kernel (routed
    there on CPU by patching the CUDA-only condition; fp32 under the interpreter): the logits of
    every step equal those of the SDPA path, the CPU path users take (unchanged)."""
    loaded = load_model(
        tiny.store("qwen3_moe"), EngineConfig(device="cpu", dtype="float32", native=True)
    )
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, loaded.model_config.vocab_size, (2, 12), generator=gen)
    prompts, feed = [ids[0, :3].tolist(), ids[1, :8].tolist()], ids[:, 8:]
    sdpa = decode_steps(loaded, prompts, feed, "cpu")
    calls = []

    def counted(*args):
        calls.append(args[4].clone())  # positions
        return decode_attention(*args)

    monkeypatch.setattr(layers, "_decode_kernel_applies", lambda x, tokens: tokens == 1)
    monkeypatch.setattr(layers, "decode_attention", counted)
    kernel = decode_steps(loaded, prompts, feed, "cpu")
    layer_count = loaded.model_config.num_layers
    assert len(calls) == feed.shape[1] * layer_count  # every decode step, every layer
    assert calls[0].tolist() == [3, 8] and calls[-1].tolist() == [6, 11]
    assert (kernel - sdpa).abs().max().item() <= 1e-5


@pytest.mark.gpu
def test_native_cuda_decode_matches_prefill(tiny):
    """On CUDA decode steps run the kernel; in fp32 their logits match a prefill of the whole
    sequence (SDPA)."""
    config = EngineConfig(device="cuda", dtype="float32", native=True)
    loaded = load_model(tiny.store("qwen3_moe"), config)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, loaded.model_config.vocab_size, (1, 12), generator=gen).cuda()
    steps = decode_steps(loaded, [ids[0, :5].tolist()], ids[:, 5:11], "cuda")[:, 0]  # [7, V]
    cache = loaded.model.new_cache(1, 48, loaded.dtype, "cuda")
    with torch.inference_mode():
        full = loaded.model(ids[:, :11], torch.arange(11, device="cuda")[None], cache)[0]
    assert (steps - full[4:11]).abs().max().item() <= 1e-4
